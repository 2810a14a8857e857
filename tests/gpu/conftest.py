"""GPU test configuration: the ``gpu`` marker (select with ``pytest -m gpu``) and the seed.

Kernel tests draw fresh random inputs every session from ``TINYLOOP_TEST_SEED``; it is chosen
here when unset and printed in the report header, so a failing run can be replayed exactly.
"""

import os

import numpy as np


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped where CUDA is absent)")
    if not os.environ.get("TINYLOOP_TEST_SEED"):
        os.environ["TINYLOOP_TEST_SEED"] = str(np.random.SeedSequence().entropy % 2**31)


def pytest_report_header(config):
    return f"TINYLOOP_TEST_SEED={os.environ.get('TINYLOOP_TEST_SEED')}"
