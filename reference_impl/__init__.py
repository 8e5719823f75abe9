"""A small, tested reference trainer for data-parallel PyTorch (DDP and FSDP2).

Every module holds one concern; the handbook shows named sections of these files,
so what a reader copies is exactly what the tests run.
"""

__version__ = "0.1.0"
