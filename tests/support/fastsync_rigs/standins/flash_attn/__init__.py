"""STAND-IN for the real ``flash_attn`` (which does not install on a CPU-only host), put on
PYTHONPATH only by fastsync's tests and CPU examples. OpenRLHF 0.11.2's
``openrlhf/models/ring_attn_utils.py`` imports ``flash_attn.bert_padding`` and
``flash_attn.utils.distributed`` at top level, unguarded; these pure-torch helpers are enough
for it to import. No attention kernel is provided: anything that calls one fails loudly."""

__version__ = "0.0.0+fastsync-standin"
FASTSYNC_STANDIN = True
