"""`python -m reference_impl.bench NAME ...`: see the package docstring."""

from reference_impl.bench import main
from reference_impl.distributed import exit_after

exit_after(main)
