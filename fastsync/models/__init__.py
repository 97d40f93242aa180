"""Parameter inventories of real models from their configs (dimensions only)."""

from __future__ import annotations

from fastsync.models.archs import ARCHITECTURES
from fastsync.models.inventory import Inventory, config_dtype, inventory_from_config, load_inventory
from fastsync.models.presets import PRESETS

__all__ = ["Inventory", "load_inventory", "inventory_from_config", "config_dtype", "ARCHITECTURES", "PRESETS"]
