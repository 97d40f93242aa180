"""Test oracles and synthetic inputs: not used by the library itself.

* ``synthetic``: synthetic layouts and tensors for planner and executor tests.
* ``random_layout``: random model configs and layouts for property tests.
* ``local``: an in-process executor that applies a plan by copies (the oracle the transports
  are checked against).
"""
