"""`rlship` command line: run, trainer, produce, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

import redis

# Subcommand -> (module, its argument-adding function, its main function, description).
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "run": ("orchestrator.run", "add_arguments", "main",
            "the whole system on this machine: Redis, workers, trainer ranks, producer, orchestrator"),
    "orchestrate": ("orchestrator.run", "add_orchestrate_arguments", "orchestrate_main",
                    "the orchestrator alone (what `run` starts)"),
    "trainer": ("orchestrator.run", "add_trainer_arguments", "trainer_main",
                "one reference trainer rank: receive, check, acknowledge each step"),
    "produce": ("orchestrator.producer", "add_arguments", "main", "the synthetic rollout producer"),
    "bench encode": ("orchestrator.bench.encode", "add_arguments", "main",
                     "encoder/decoder memory and speed, against msgpack and msgspec"),
    "bench loop": ("orchestrator.bench.loop", "add_arguments", "main",
                   "event-loop lag while shipping: stages inline, in threads, in Celery workers"),
    "config show": ("orchestrator.config_cli", "add_arguments", "main",
                    "the effective settings (environment < --config TOML < flags), secrets masked"),
    "chaos": ("orchestrator.chaos", "add_arguments", "main",
              "a seeded run while its workers and orchestrator are killed, against a fault-free one"),
    "status": ("orchestrator.status", "add_arguments", "main",
               "a run's live status from another terminal; without RUN_ID, the runs Redis holds"),
    "doctor": ("orchestrator.doctor", "add_arguments", "main",
               "what a run needs (Redis, password, eviction, ports, output dir, workers): one line each"),
    "report": ("orchestrator.report", "add_arguments", "main",
               "report.html and PNG charts of a run from its metrics.jsonl"),
}  # fmt: skip


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  rlship {name:<{width}}  {text}" for name, (*_, text) in COMMANDS.items()]
    return "usage: rlship COMMAND [options]   (rlship COMMAND --help for its options)\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the longest command matching the arguments; import only its module."""
    argv = sys.argv[1:] if argv is None else argv
    for name in sorted(COMMANDS, key=lambda n: -len(n.split())):
        words = name.split()
        if argv[: len(words)] == words:
            module_name, add_arguments, main_function, help_text = COMMANDS[name]
            parser = argparse.ArgumentParser(prog=f"rlship {name}", description=help_text)
            module = importlib.import_module(module_name)
            getattr(module, add_arguments)(parser)
            args = parser.parse_args(argv[len(words) :])
            try:
                return int(getattr(module, main_function)(args) or 0)
            except redis.RedisError as exc:
                # What the commands' own checks did not foresee: still one line, no traceback.
                print(f"rlship {name}: Redis: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 3
            except OSError as exc:
                print(f"rlship {name}: {exc}", file=sys.stderr)
                return 1
    print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
    return 0 if argv and argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
