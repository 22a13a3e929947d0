"""Not imported: this directory goes on the captured command's PYTHONPATH (see sitecustomize.py).
The file makes setuptools ship it."""
