"""Errors shared across the package's entry points."""


class CliError(Exception):
    """A user-facing error of the ``rlhfmem`` command: printed as one line, exit status 2.

    Lives in its own module so that ``python -m pytest_rlhfmem.cli`` (where the CLI module is ``__main__``)
    and the ``rlhfmem`` console script catch the same class."""


class RlhfmemWarning(UserWarning):
    """A pytest warning of the plugin's: something a run did that the test does not fail for but a reader should see
    (processes the program left running after it ended)."""
