"""TinyLoop's benchmarks: ``python -m benchmarks`` lists them, ``python -m benchmarks NAME
[args]`` runs one. Each benchmark module exposes ``main(argv)`` and does nothing at import;
what they share lives in ``benchmarks.common``."""
