"""What bench/first_contact.py and its steps (_first_steps.py) share: where the checkout is, the kill grace, and the
one writer of the results file. Its own module, so that neither imports the other's."""

from __future__ import annotations

import fcntl
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KILL_GRACE_S = 5  # SIGINT first (pytest prints its summary), SIGKILL this much later


def publish(path: str, section: str, key: str | None, value) -> None:
    """data[section][key] = value (key None: data[section] = value) in the JSON file at `path`: under a lock (the
    correctness processes write at once), then a temporary file renamed over it, so that a reader (or a kill) never
    meets half a file."""
    # the lock is the results' own folder (flock takes a directory): no lock file, nothing in a shared /tmp to plant
    lk = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        if key is None:
            data[section] = value
        else:
            data.setdefault(section, {})[key] = value
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(path + ".tmp", path)
    finally:
        os.close(lk)  # releases the lock


def finite(x):
    """A float JSON can hold (NaN and infinities become None)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
