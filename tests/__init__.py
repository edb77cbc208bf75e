"""The test suite, laid out like the package (ops/, kernels/, nn/, peft/, checkpoint/, distributed/, integration/).

Every folder is a package, so that pytest (default import mode) imports a test file as `tests.<folder>.<file>` with the
repository root on sys.path, and the shared helpers as `tests._tolerance`, `tests.kernels._kernel_ref`, ... Folders
are never put on sys.path themselves: `tests/peft/` must not be found by `import peft`, nor `tests/kernels/` by a
probe for the `kernels` package (as a namespace package, when the real one is not installed).
"""
