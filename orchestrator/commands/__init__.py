"""The `rlship` commands, one module each (`cli` finds and imports them):

- `run`: the whole system on one machine, its children started and stopped by PID
  (`processes`), its progress drawn from Redis (`progress`), a summary at the end;
- `orchestrate`, `trainer`, `produce`: the children `run` starts (the orchestrator, a
  reference trainer rank, the synthetic rollout producer), each usable alone;
- `status`: a run's progress from another terminal; `doctor`: the checks a run makes
  before it starts (`checks`), and more; `config`: the effective settings;
- `chaos`: a run under kills against a fault-free one; `report`: charts of a run;
- `bench`: the encoder and the event loop under the ship path, against their baselines.
"""
