"""``fastsync plugins``: what is registered, and which plugin it came from."""

from __future__ import annotations

import argparse
import json

from fastsync import plugins


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list registered plugins and what they provide")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def collect() -> dict:
    registries = {
        "transports": {n: {"plugin": r.plugin, **{k: v for k, v in r.extra.items() if k in ("available", "why")}}
                       for n, r in plugins.transports().items()},
        "layouts": {n: {"plugin": r.plugin, "side": r.extra.get("side")} for n, r in plugins.layout_kinds().items()},
        "models": {n: {"plugin": r.plugin} for n, r in plugins.model_presets().items()},
        "architectures": {n: {"plugin": r.plugin} for n, r in plugins.architectures().items()},
        "transforms": {n: {"plugin": r.plugin} for n, r in plugins.transforms().items()},
    }
    from fastsync.engines.vllm.names import BUILDERS

    # Name maps answer a firstresult hook per architecture, so they cannot be enumerated; list the
    # built-in ones and which plugins implement the hook.
    name_map_plugins = sorted(r["name"] for r in plugins.list_plugins() if "fastsync_name_map" in r["hooks"])
    registries["name_maps"] = {arch: {"plugin": "builtin_namemaps"} for arch in sorted(BUILDERS)}
    return {"plugins": plugins.list_plugins(), "registered": registries, "name_map_plugins": name_map_plugins}


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{'plugin':24} {'source':34} hooks")
    for row in info["plugins"]:
        print(f"{row['name']:24} {row['source']:34} {', '.join(h.removeprefix('fastsync_') for h in row['hooks'])}")
    for kind, regs in info["registered"].items():
        if kind == "name_maps":
            print(f"\nname maps (vLLM engine names; plugins answering fastsync_name_map: "
                  f"{', '.join(info['name_map_plugins'])}):")
            for arch in regs:
                print(f"  {arch}")
            continue
        print(f"\n{kind}:")
        for name, meta in sorted(regs.items()):
            extra = ""
            if meta.get("available") is False:
                extra = f"  (unavailable: {meta.get('why', '')})"
            elif "side" in meta:
                extra = f"  [{meta['side']}]"
            print(f"  {name:22} from {meta['plugin']}{extra}")
    return 0
