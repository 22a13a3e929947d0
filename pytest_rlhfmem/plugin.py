"""pytest face of pytest-rlhfmem (filled in by the plugin work)."""
