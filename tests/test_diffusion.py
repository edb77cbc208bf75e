"""Diffusion models end to end (issue #11): fp8 bases for every Linear and Conv2d of a diffusers UNet and of a small
DiT, DoRA on attention + feed-forward + convolutions, bf16 autocast training, parity with PEFT, save and reload with
plain PEFT."""

import subprocess
import sys

import pytest


def test_peft_registration_survives_a_find_spec_probe():
    """diffusers (and transformers) probe optional packages with importlib.util.find_spec before importing them; the
    post-import hook that registers dorafp8 with PEFT must still fire on the import that follows."""
    code = ("import importlib.util, dorafp8\n"
            "assert importlib.util.find_spec('peft') is not None\n"
            "import peft\n"
            "from dorafp8 import peft_integration as pi\n"
            "print('registered' if pi._ORIG_CREATE_NEW_MODULE is not None else 'NOT registered')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "registered"
