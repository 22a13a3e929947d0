"""Phase marks for training frameworks, each in one line of the user's script (``trl.py``: Hugging Face
``Trainer`` and TRL's online trainers). Built on the public recorder API (``record/api.py``); without an active
capture every mark is a no-op."""
