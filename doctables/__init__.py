"""Generators of the tables the README and docs/ restate from committed budgets and recorded runs.

Each prints one markdown block; a doc holds it between ``<!-- generated: python -m doctables.MODULE ARGS -->`` and
``<!-- end generated -->``, and ``tests/test_generated_tables.py`` fails when the block differs from what the command
prints now (run it again after a budget update and paste its output)."""
