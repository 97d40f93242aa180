"""The hook layer: built-ins arrive through entry points, third-party plugins register the same way."""

from __future__ import annotations

import pytest

from fastsync import hookimpl, plugins
from fastsync.cli import main
from fastsync.errors import ConfigError, PluginError


def test_builtins_come_from_entry_points():
    rows = {r["name"]: r for r in plugins.list_plugins()}
    for name in ("builtin_transports", "builtin_layouts", "builtin_namemaps", "builtin_models"):
        assert rows[name]["source"] == "entry point (fastsync-rl)"


class _ToyTransportPlugin:
    @hookimpl
    def fastsync_register_transports(self, register):
        register("toy", lambda **kw: ("toy", kw), available=False, why="pip install toy-transport")


def test_registered_plugin_is_listed_and_unavailable_transport_says_why():
    name = plugins.register_plugin(_ToyTransportPlugin(), name="toy_plugin")
    try:
        regs = plugins.transports()
        assert regs["toy"].plugin == "toy_plugin"
        with pytest.raises(ConfigError, match="'toy'.*toy_plugin.*pip install toy-transport"):
            plugins.get_transport_factory("toy")
        with pytest.raises(ConfigError, match="unknown transport 'nope'"):
            plugins.get_transport_factory("nope")
    finally:
        plugins.unregister_plugin(name)
    assert "toy" not in plugins.transports()


def test_name_clash_between_plugins_names_both():
    a, b = _ToyTransportPlugin(), _ToyTransportPlugin()
    na = plugins.register_plugin(a, name="toy_a")
    nb = plugins.register_plugin(b, name="toy_b")
    try:
        with pytest.raises(PluginError, match="'toy' registered by both 'toy_a' and 'toy_b'|'toy' registered by both 'toy_b' and 'toy_a'"):
            plugins.transports()
    finally:
        plugins.unregister_plugin(na)
        plugins.unregister_plugin(nb)


def test_plugins_command_lists_a_runtime_plugin(capsys):
    name = plugins.register_plugin(_ToyTransportPlugin(), name="toy_cli")
    try:
        assert main(["plugins"]) == 0
        out = capsys.readouterr().out
        assert "toy_cli" in out and "registered at run time" in out
        assert "unavailable: pip install toy-transport" in out
        assert "name maps" in out and "Qwen3MoeForCausalLM" in out and "DeepseekV3ForCausalLM" in out
    finally:
        plugins.unregister_plugin(name)


class _ToyArchPlugin:
    """A third-party architecture with an awkward size, and a name map for a second engine."""

    @hookimpl
    def fastsync_register_architectures(self, register):
        register("ToyForCausalLM", lambda cfg: [("embed.weight", (cfg["vocab_size"], 37))], model_types=("toy",))

    @hookimpl
    def fastsync_name_map(self, architecture, config, engine):
        if architecture == "ToyForCausalLM" and engine == "toyengine":
            from fastsync.layout.namemap import NameMap

            return NameMap(architecture, engine, [])
        return None


def test_architecture_and_engine_name_map_come_from_hooks():
    from fastsync.errors import LayoutError
    from fastsync.layout.namemap import get_name_map
    from fastsync.models.inventory import inventory_from_config

    with pytest.raises(ConfigError, match="unsupported architecture 'ToyForCausalLM'"):
        inventory_from_config({"architectures": ["ToyForCausalLM"], "vocab_size": 51})
    name = plugins.register_plugin(_ToyArchPlugin(), name="toy_arch")
    try:
        inv = inventory_from_config({"model_type": "toy", "vocab_size": 51, "torch_dtype": "bfloat16"})
        assert inv.architecture == "ToyForCausalLM" and inv.params["embed.weight"].shape == (51, 37)
        assert plugins.architectures()["ToyForCausalLM"].plugin == "toy_arch"
        from fastsync.cli.plugins_cmd import collect

        assert collect()["registered"]["architectures"]["ToyForCausalLM"] == {"plugin": "toy_arch"}
        nm = get_name_map("ToyForCausalLM", inv.config, engine="toyengine")
        assert (nm.architecture, nm.engine) == ("ToyForCausalLM", "toyengine")
        with pytest.raises(LayoutError, match="'ToyForCausalLM' on engine 'vllm'"):
            get_name_map("ToyForCausalLM", inv.config)  # the built-in vLLM maps do not know it
        # the built-in maps answer only for their own engine
        assert plugins.hook().fastsync_name_map(architecture="Qwen3ForCausalLM", config={}, engine="toyengine") is None
    finally:
        plugins.unregister_plugin(name)
    assert "ToyForCausalLM" not in plugins.architectures()
