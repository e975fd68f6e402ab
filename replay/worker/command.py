"""Run the reference worker: a torch model of the V4.1 cache structure serving kvstore.v1.Worker.

It resumes prompts by the planner's plans against the kvstore server at
--target: fetches global-KV blocks and SWA snapshots, replays, prefills,
greedy-decodes, and stores the new blocks and snapshots back (docs/WORKER.md).
Health and reflection are served on the same port. It prints
"kvstore worker listening on HOST:PORT" once it serves, and stops on SIGTERM or
SIGINT. In production the inference engine speaks this protocol itself; this
worker is its runnable example and the test stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from kvstore.commands import add_connection_arguments, client_options
from kvstore.errors import ConfigError
from replay.worker.settings import WorkerSettings

DEFAULT_TARGET = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"the kvstore server to fetch from and store to (default {DEFAULT_TARGET})")
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (the tiny fixture of docs/FORMAT.md) or the path of a config.json (default tiny)")
    parser.add_argument("--weights", type=Path, help="weights file to load (default: seeded random weights)")
    parser.add_argument("--port", type=int, default=WorkerSettings.port,
                        help=f"TCP port (default {WorkerSettings.port}; 0 picks a free one)")
    parser.add_argument("--host", default=WorkerSettings.host, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N (default cpu)")
    parser.add_argument("--namespace", default="",
                        help="tenant whose store connection opens at start (a Run names its own; default: the "
                             "token's tenant, 'default' without auth)")
    parser.add_argument("--max-prompt-tokens", type=int, default=WorkerSettings.max_prompt_tokens,
                        help="longest prompt a Run takes")
    parser.add_argument("--max-new-tokens", type=int, default=WorkerSettings.max_new_tokens,
                        help="most greedy tokens a Run decodes")
    parser.add_argument("--store-timeout", type=float, default=WorkerSettings.store_timeout_s,
                        help="seconds each store call may take")
    parser.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                        help="on CUDA, bounded replays run through CUDA graphs, with the eager step's logits "
                             "(default on; off: every step eager)")
    add_connection_arguments(parser)  # --token (KVSTORE_TOKEN) and TLS: how the worker reaches the store


def load_model(spec: str, weights: Path | None, device: str) -> Any:
    """The reference model named by --model (and --weights) on `device`.

    Raises:
        ConfigError: the config file cannot be read or parsed, or the weights do not load.
    """
    from replay.model import TINY_MODEL, ReferenceModel, from_config

    if spec == "tiny":
        config = TINY_MODEL
    else:
        path = Path(spec)
        try:
            config = from_config(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model {spec}: cannot read a config.json there: {exc}",
                              hint="give 'tiny' or the path of the model's config.json") from None
    try:
        model = ReferenceModel(config, device=device)
    except (RuntimeError, AssertionError) as exc:  # torch: no such device
        raise ConfigError(f"--device {device}: {exc}", hint="use cpu, or a cuda device this host has") from None
    if weights is not None:
        try:
            model.load_weights(weights)
        except (OSError, RuntimeError, KeyError) as exc:
            raise ConfigError(f"--weights {weights}: {exc}", hint="give weights saved for this --model") from None
    return model


def run(args: argparse.Namespace) -> int:
    """Start the worker and serve until SIGTERM or SIGINT."""
    settings = WorkerSettings(store_target=args.target, host=args.host, port=args.port, device=args.device,
                              max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                              store_timeout_s=args.store_timeout, cuda_graphs=args.cuda_graphs == "on")
    asyncio.run(serve(settings, load_model(args.model, args.weights, args.device), namespace=args.namespace,
                      credentials=client_options(args)))
    return 0


async def serve(settings: WorkerSettings, model: Any, *, namespace: str = "",
                credentials: dict[str, Any] | None = None) -> None:
    """Connect to the store, serve the worker, and stop cleanly on SIGTERM or SIGINT.

    `credentials` are the store client's `token=` and `tls=` (kvstore.commands.client_options).
    """
    from replay.worker.runner import Runner
    from replay.worker.service import start
    from replay.worker.stores import StoreClients

    stores = StoreClients(settings.store_target, geometry=model.config.geometry.name,
                          timeout_s=settings.store_timeout_s, **(credentials or {}))
    try:
        stores.client(namespace)
        running = await start(settings, Runner(model, stores, settings))
    except BaseException:
        stores.close()
        raise
    print(f"kvstore worker listening on {settings.host}:{running.port}", flush=True)
    print(f"kvstore worker model {model.config.geometry.name} on {settings.device}, store {settings.store_target} "
          f"({stores.block_tokens}-token blocks)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("kvstore worker shutting down", file=sys.stderr, flush=True)
    await running.stop(settings.grace_s)
    print("kvstore worker stopped", file=sys.stderr, flush=True)
