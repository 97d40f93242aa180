"""The end-to-end demo (``fastsync demo`` / ``make demo``) and the tiny checkpoints it builds."""
