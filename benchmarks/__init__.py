"""The hand-run studies and speed benchmarks, run as modules from the repository's root (``python -m benchmarks.speed``)
so that they import their shared kit (:mod:`benchmarks.studykit`, :mod:`benchmarks.timing`) as a package; the library
never imports them."""
