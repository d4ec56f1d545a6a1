"""Several servers, one memory of conversations: two strata-serve instances (two real
engines, two slot directories) and one shared tier, a directory or S3 (moto's server on
loopback). A conversation parked on one continues on the other with its state reused,
and back on the first, the newer state is fetched, never the stale local copy."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from click.testing import CliRunner

import strata_serve
from strata_auto_sessions.config import SharedConfig
from strata_auto_sessions.shared import DirectoryTier, Head
from strata_auto_sessions.shared.sweep import sweep
from strata_serve.cli import cli
from strata_serve.testing import ask, conversation

from strata_auto_sessions.testing import is_parked
from .shared_fixtures import new_bucket
from .test_auto_sessions import key_of, log_lines, parking
from .test_shared_tier import ConditionBlindS3


async def two_servers(auto_client, tmp_path, url, **more):
    shared = {"url": url, "retry_s": 0.5, **more}
    one = await auto_client(engine={"slot_save_path": str(tmp_path / "one")}, idle_save_s=0, shared=shared)
    two = await auto_client(engine={"slot_save_path": str(tmp_path / "two")}, idle_save_s=0, shared=shared)
    return one, two


def then(messages, answer, text):
    return messages + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                       {"role": "user", "content": text}]


async def settled(*clients):
    for client in clients:
        assert await parking(client).shared.settled(30), "uploads ended"


async def shared_head(client, name):
    return (await parking(client).shared.tier.head(name))[0]


async def test_a_conversation_moves_between_servers_and_back_with_its_newest_state(auto_client, tmp_path,
                                                                                   shared_url):
    one, two = await two_servers(auto_client, tmp_path, shared_url)
    a = conversation("voyage")
    first = await ask(one, a)
    await ask(one, conversation("other-one"))  # a switch: A is saved on one, then uploaded
    await settled(one)
    key = key_of(one, a)
    name = parking(one).store.bin_name(key)
    saved = parking(one).store.sidecar(key)
    assert parking(one).stats.shared_uploads == 1 and (await shared_head(one, name)).generation == 1

    a2 = then(a, first, "And then?")
    second = await ask(two, a2)  # two never saw A: fetched from the shared tier, restored
    assert parking(two).stats.shared_fetches == 1 and parking(two).stats.restores == 1
    assert second["timings"]["cache_n"] >= saved.tokens - 3, (second["timings"], saved.tokens)
    await ask(two, conversation("other-two"))  # A's next turn is saved on two: generation 2
    await settled(two)
    newer = await shared_head(two, name)
    assert newer.generation == 2 and newer.tokens > saved.tokens

    a3 = then(a2, second, "And after that?")
    third = await ask(one, a3)  # one's own copy is generation 1: the newer state is fetched
    assert parking(one).stats.shared_fetches == 1 and parking(one).stats.restores == 1
    assert third["timings"]["cache_n"] >= newer.tokens - 3, (third["timings"], newer.tokens)
    assert parking(one).store.sidecar(key).tokens == newer.tokens


async def test_a_save_made_from_an_older_turn_never_overwrites_a_newer_one(auto_client, tmp_path, caplog,
                                                                           shared_url):
    one, two = await two_servers(auto_client, tmp_path, shared_url)
    a = conversation("race")
    first = await ask(one, a)
    await ask(one, conversation("other-one"))
    await settled(one)
    await ask(two, then(a, first, "On two."))  # two holds A, from generation 1, in its slot
    back = await ask(one, then(a, first, "On one."))  # one moves A on from its own copy...
    await ask(one, conversation("other-one"))  # ...and shares it: generation 2
    await settled(one)
    key = key_of(one, a)
    name = parking(one).store.bin_name(key)
    assert (await shared_head(one, name)).generation == 2
    await ask(two, conversation("other-two"))  # two saves its A, made from generation 1 and gone
    await settled(two)  # another way ("On two.", not "On one."): another conversation, a head of its own
    head = await shared_head(two, name)
    assert head.generation == 2 and head.tokens == parking(one).store.sidecar(key).tokens
    assert parking(two).stats.shared_uploads == 1 and parking(two).stats.shared_uploads_lost == 0
    # Back on two, A is the newer shared state, not two's own.
    again = await ask(two, then(then(a, first, "On one."), back, "Next."))
    assert parking(two).stats.shared_fetches == 2
    assert again["timings"]["cache_n"] >= head.tokens - 3


async def test_sessions_rm_removes_from_the_shared_tier_and_another_server_forgets_it(
        auto_client, tmp_path, shared_url, s3_env):
    one, two = await two_servers(auto_client, tmp_path, shared_url)
    a = conversation("forget")
    first = await ask(one, a)
    await ask(one, conversation("other-one"))
    await settled(one)
    await ask(two, then(a, first, "More."))  # two fetched A: a copy in its directory
    await ask(two, conversation("other-two"))
    await settled(two)
    key = key_of(one, a)
    name = parking(two).store.bin_name(key)
    assert is_parked(parking(two).store.directory, key)

    config = tmp_path / "strata.toml"
    config.write_text(f'[engine]\nslot_save_path = "{tmp_path / "one"}"\n'
                      f'[plugins.auto_sessions.shared]\nurl = "{shared_url}"\n')
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["sessions", "--config", str(config), "rm", key])
    assert result.exit_code == 0, result.output
    assert f"removed {name} from the shared tier" in result.output
    assert (await shared_head(two, name)).tombstone

    restores = parking(two).stats.restores
    reply = await ask(two, then(a, first, "More."))  # two's copy goes, never restored
    assert parking(two).stats.shared_removed_here == 1 and parking(two).stats.restores == restores
    assert not is_parked(parking(two).store.directory, key)
    assert reply["timings"]["cache_n"] < 40
    await ask(two, conversation("other-two"))  # a new state of A, begun after the removal, is shared again
    await settled(two)
    head = await shared_head(two, name)
    assert not head.tombstone and head.upload is not None


class UnreachableTier(DirectoryTier):
    """A shared directory whose mount hangs while ``down`` is set (a test double: the real
    tiers cannot be made to hang on cue)."""

    down = True

    async def _hang(self):
        if self.down:
            await asyncio.sleep(3600)

    async def put(self, name, source):
        await self._hang()
        return await super().put(name, source)

    async def fetch(self, name, target):
        await self._hang()
        return await super().fetch(name, target)

    async def head(self, name):
        await self._hang()
        return await super().head(name)

    async def heads(self, prefix):
        await self._hang()
        return await super().heads(prefix)

    async def put_head(self, name, head, expect):
        await self._hang()
        return await super().put_head(name, head, expect)


class UnreachablePlugin:
    strata_name = "unreachable_tier"

    def __init__(self, root):
        self.tier = UnreachableTier(root)

    @strata_serve.hookimpl
    def auto_sessions_shared_tier(self, config):
        return self.tier


async def test_with_the_store_down_requests_are_answered_and_uploads_resume_when_it_returns(
        auto_client, tmp_path, caplog):
    (tmp_path / "shared").mkdir()
    plugin = UnreachablePlugin(tmp_path / "shared")
    client = await auto_client(plugin, idle_save_s=0,
                               shared={"url": f"file://{tmp_path / 'shared'}", "timeout_s": 0.3, "retry_s": 0.3})
    a, b = conversation("down-a"), conversation("down-b")
    began = time.monotonic()
    await ask(client, a)
    await ask(client, b)  # A saved locally, its upload waits for the store
    back = await ask(client, a)  # restored from the slot directory alone
    took = time.monotonic() - began
    # The store is checked beside them, never on their path: one check alone may take 4 x 0.3 s.
    assert took < 1.2, f"three requests took {took:.2f} s with the store down"
    stats = parking(client).stats
    assert stats.restores == 1 and back["timings"]["cache_n"] > 100
    deadline = time.monotonic() + 30  # the uploads fail beside the requests, which never wait for them
    while not stats.shared_upload_failures and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert stats.shared_upload_failures >= 1 and stats.shared_uploads == 0
    assert any("does not answer" in line or "did not answer" in line for line in log_lines(caplog))

    plugin.tier.down = False  # the store is back: the upload waiting lands
    names = [parking(client).store.bin_name(key_of(client, m)) for m in (a, b)]
    deadline = time.monotonic() + 30
    while not all([await plugin.tier.head(n) for n in names]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert stats.shared_uploads == 2 and all([await plugin.tier.head(n) for n in names])


class BlindPlugin:
    strata_name = "blind_tier"

    def __init__(self, tier):
        self.tier = tier

    @strata_serve.hookimpl
    def auto_sessions_shared_tier(self, config):
        return self.tier


async def test_a_store_that_ignores_conditions_is_refused_at_start(auto_client, s3_env, caplog):
    caplog.set_level(logging.INFO)
    bucket = await new_bucket(s3_env)
    client = await auto_client(BlindPlugin(ConditionBlindS3(bucket, "p", endpoint_url=s3_env)),
                               shared={"url": f"s3://{bucket}/p"})
    assert parking(client).shared is None and parking(client).stats.shared_refused == 1
    assert any("ignores conditional writes" in line and "shared mode is refused" in line
               for line in log_lines(caplog))
    a = conversation("blind")
    await ask(client, a)
    await ask(client, conversation("blind-b"))
    assert parking(client).stats.saves == 1  # local parking goes on


async def test_local_pruning_leaves_the_shared_copies(auto_client, tmp_path):
    (tmp_path / "shared").mkdir()
    client = await auto_client(idle_save_s=0, keep=1, shared={"url": f"file://{tmp_path / 'shared'}"})
    a, b, c = conversation("p-a"), conversation("p-b"), conversation("p-c")
    for messages in (a, b, c):
        await ask(client, messages)
    await settled(client)
    stats = parking(client).stats
    assert stats.prunes >= 1 and stats.shared_uploads == 2
    for messages in (a, b):
        assert await parking(client).shared.tier.head(parking(client).store.bin_name(key_of(client, messages)))


async def test_the_sweep_forgets_old_conversations_and_unnamed_objects_after_their_lease(tmp_path):
    tier = DirectoryTier(tmp_path)
    config = SharedConfig(url=f"file://{tmp_path}", max_age_days=1, transfer_timeout_s=0.1, lease_s=0.5)
    source = tmp_path / "s.bin"
    source.write_bytes(b"state")
    for obj in ("auto-old.bin.u1", "auto-old.json.u1", "auto-new.bin.u2", "auto-new.json.u2", "auto-new.bin.u1"):
        await tier.put(obj, source)
    await tier.put_head("auto-old.bin", Head(generation=1, upload="u1", written=time.time() - 2 * 86400), None)
    await tier.put_head("auto-new.bin", Head(generation=2, upload="u2"), None)

    async def call(work):
        return await asyncio.wait_for(work, 5)

    assert await sweep(tier, config, call) == (1, 0)  # the old head goes; its objects keep their lease
    assert await tier.head("auto-old.bin") is None and await tier.head("auto-new.bin") is not None
    assert len(await tier.list("auto-")) == 5
    await asyncio.sleep(0.6)
    assert await sweep(tier, config, call) == (0, 3)  # past the lease: only what no head names
    assert sorted(item.name for item in await tier.list("auto-")) == ["auto-new.bin.u2", "auto-new.json.u2"]


def test_a_bad_shared_url_is_refused_in_the_config():
    with pytest.raises(ValueError, match="file:// or s3://"):
        SharedConfig(url="http://x")
    with pytest.raises(ValueError, match="lease_s"):
        SharedConfig(url="file:///mnt/strata", transfer_timeout_s=600, lease_s=60)


async def test_a_server_holding_a_removed_conversation_never_uploads_it_back(auto_client, tmp_path, shared_url,
                                                                              s3_env):
    one, two = await two_servers(auto_client, tmp_path, shared_url)
    a = conversation("undead")
    first = await ask(one, a)
    await ask(one, conversation("other-one"))
    await settled(one)
    await ask(two, then(a, first, "Still here?"))  # two holds A in its slot, from the shared state
    key = key_of(one, a)
    name = parking(two).store.bin_name(key)
    config = tmp_path / "strata.toml"
    config.write_text(f'[engine]\nslot_save_path = "{tmp_path / "one"}"\n'
                      f'[plugins.auto_sessions.shared]\nurl = "{shared_url}"\n')
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["sessions", "--config", str(config), "rm", key])
    assert result.exit_code == 0, result.output

    await ask(two, conversation("other-two"))  # two saves its A, begun before the removal
    await settled(two)
    assert parking(two).stats.shared_uploads_removed == 1
    assert (await shared_head(two, name)).tombstone
    assert not is_parked(parking(two).store.directory, key)
