"""Pipelines whose Lua scripts survive a Redis restart in the middle of `execute`.

redis-py loads a pipeline's scripts (SCRIPT EXISTS, then SCRIPT LOAD of the missing) once,
before its first attempt, and retries only the sending. A Redis restarted without
persistence between the two has an empty script cache, so the retry's EVALSHA fails with
NOSCRIPT and the work the pipeline carried (an orchestrator's releases and outcomes, a
finalize's outcomes) is lost with an error (seen in CI: `rlship run` with its Redis killed).
These pipelines load their scripts again on the new connection before every attempt after
the first. `connect_redis` and `connect_redis_async` make their clients with them.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.client
import redis.client


class ScriptReloadingPipeline(redis.client.Pipeline):
    _attempts = 0  # of the current `execute`

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        self._attempts = 0
        return super().execute(raise_on_error)

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        self._reload_scripts_on_retry(connection)
        return super()._execute_transaction(connection, commands, raise_on_error)

    def _execute_pipeline(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        self._reload_scripts_on_retry(connection)
        return super()._execute_pipeline(connection, commands, raise_on_error)

    def _reload_scripts_on_retry(self, connection: Any) -> None:
        self._attempts += 1
        if self._attempts == 1:
            return
        for script in self.scripts:
            connection.send_command("SCRIPT", "LOAD", script.script)
            script.sha = self.parse_response(connection, "SCRIPT LOAD")


class AsyncScriptReloadingPipeline(redis.asyncio.client.Pipeline):
    _attempts = 0  # of the current `execute`

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        self._attempts = 0
        return await super().execute(raise_on_error)

    async def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        await self._reload_scripts_on_retry(connection)
        return await super()._execute_transaction(connection, commands, raise_on_error)

    async def _execute_pipeline(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        await self._reload_scripts_on_retry(connection)
        return await super()._execute_pipeline(connection, commands, raise_on_error)

    async def _reload_scripts_on_retry(self, connection: Any) -> None:
        self._attempts += 1
        if self._attempts == 1:
            return
        for script in self.scripts:
            await connection.send_command("SCRIPT", "LOAD", script.script)
            script.sha = await self.parse_response(connection, "SCRIPT LOAD")


class ScriptSafeRedis(redis.Redis):
    """A client whose pipelines are `ScriptReloadingPipeline`s."""

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> ScriptReloadingPipeline:
        return ScriptReloadingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class AsyncScriptSafeRedis(aioredis.Redis):
    """An asyncio client whose pipelines are `AsyncScriptReloadingPipeline`s."""

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> AsyncScriptReloadingPipeline:
        pool, callbacks = self.connection_pool, self.response_callbacks
        return AsyncScriptReloadingPipeline(pool, callbacks, transaction, shard_hint)
