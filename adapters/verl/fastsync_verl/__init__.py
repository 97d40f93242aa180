"""fastsync for verl. Importing this package registers the ``fastsync`` checkpoint-engine
backend in verl's ``CheckpointEngineRegistry`` (verl imports it through
``checkpoint_engine.custom_backend_module=fastsync_verl`` or the ``verl.plugins`` entry point)."""

from fastsync_verl.checkpoint_engine import FastSyncCheckpointEngine

__all__ = ["FastSyncCheckpointEngine"]
