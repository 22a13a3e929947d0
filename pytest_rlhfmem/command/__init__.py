"""``rlhfmem capture -- COMMAND``: measure any training command, rank by rank.

- ``rank.py``: the ONE capture path of a rank (the recipes' worker uses it too): start the recorder,
  make it the public API's active handle, write progress files, and at the end replay the trace and write
  the rank's result.
- ``bootstrap/sitecustomize.py``: put on ``PYTHONPATH`` of the user's command; starts ``rank.py`` in
  every rank the moment torch is imported.
- ``run.py``: launch the command, enforce the timeout, gather the ranks (``rlhf/launch.py``'s machinery).
- ``cli.py``: the ``rlhfmem capture`` subcommand.
"""
