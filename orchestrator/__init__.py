"""The orchestrator side of rlship: an asyncio process that never touches payload bytes.

At the top of this package are the orchestrator (`orchestrator.orchestrator`, whose
docstring lists its concurrent loops and their modules) and its components; the pieces it
shares with the commands (settings, the rollout producer client, the status reader, worker
queries, logging). The `rlship` command line and every command live in
`orchestrator.commands`.
"""
