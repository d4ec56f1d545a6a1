"""auto-sessions' counters: one dataclass whose fields declare their metric."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from strata_serve import counter, gauge

from strata_auto_sessions.store import REFUSAL_REASONS

_SAVE_SKIPS = "Saves skipped, by reason"
_RESTORE_SKIPS = "Restores not attempted, by reason"
_KEPT_WHOLE = "Saves kept as whole files: the engine's state format refused the state, by reason"


@dataclass
class AutoSessionsStats:
    """Counters for other plugins, each declared as a metric where it is kept.

    ``collect_stats`` reports them as a flat dict; ``collect_metrics`` hands over this
    object, whose fields carry their exported name, help and unit (milliseconds are
    exported as seconds, Prometheus' base unit).
    """

    saves: int = counter("Conversations saved to disk", summary="saves")
    saved_tokens: int = counter("Tokens saved to disk")
    saved_bytes: int = counter("Bytes written by saves", unit="bytes")
    save_ms: float = counter("Time spent saving", name="save_seconds", unit="seconds", scale=1e-3)
    save_failures: int = counter("Saves that failed")
    sync_failures: int = counter("Background fsyncs of saved files that failed")
    save_skips_below_min: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "below_min_tokens"})
    save_skips_verdict: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "engine_verdict"})
    save_skips_unchanged: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "unchanged"})
    #: Saves not made because the model uses a sliding window and the engine runs
    #: without ``--swa-full`` (no restore of the file would be reused).
    save_skips_swa: int = counter(_SAVE_SKIPS, name="save_skips", labels={"reason": "swa"})
    idle_saves: int = counter("Saves made while the server was idle")
    restores: int = counter("Conversations restored from disk", summary="restores")
    restored_tokens: int = counter("Tokens restored from disk")
    restored_bytes: int = counter("Bytes read by restores", unit="bytes")
    restore_ms: float = counter("Time spent restoring", name="restore_seconds", unit="seconds", scale=1e-3)
    restore_failures: int = counter("Restores that failed")
    restores_withheld: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "save_failed"})
    restores_refused_damaged: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "damaged"})
    #: Files refused before the engine saw them, by reason (``store.REFUSAL_REASONS``):
    #: another model, a context too small, another KV cache type, flash-attention
    #: setting, ``--swa-full``, an engine build out of range, or not judged.
    restores_refused_other_model: int = counter(_RESTORE_SKIPS, name="restore_skips",
                                                labels={"reason": "other_model"})
    restores_refused_context: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "context"})
    restores_refused_cache_type: int = counter(_RESTORE_SKIPS, name="restore_skips",
                                               labels={"reason": "cache_type"})
    restores_refused_flash_attn: int = counter(_RESTORE_SKIPS, name="restore_skips",
                                               labels={"reason": "flash_attn"})
    restores_refused_swa: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "swa"})
    restores_refused_build: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "build"})
    restores_refused_unjudged: int = counter(_RESTORE_SKIPS, name="restore_skips", labels={"reason": "unjudged"})
    restores_not_reused: int = counter("Restores the next request barely reused")
    restores_diverged: int = counter(
        "Restores whose next request did not continue the saved conversation (an edited message, "
        "or another conversation with the same opening)")
    pauses: int = counter("Times parking paused because restores went unused")
    #: Conversations found under a key that holds another conversation, given a file of
    #: their own (a sibling), and siblings pruned to keep ``siblings`` a key.
    siblings_started: int = counter("Conversations given a file of their own beside another under the same key")
    sibling_prunes: int = counter("Siblings pruned beyond the siblings a key keeps")
    prunes: int = counter("Session files pruned")
    pruned_bytes: int = counter("Bytes of session files pruned", unit="bytes")
    #: Conversations without a file of their own started from another one's (a fallback
    #: plugin chose it), the tokens restored so, and how many of those the next request reused.
    prefix_restores: int = counter("Conversations started from another conversation's file")
    prefix_restored_tokens: int = counter("Tokens restored from another conversation's file")
    prefix_reused_tokens: int = counter("Tokens of another conversation's file the next request reused")

    #: Switches left to the engine's RAM prompt cache (``ram_first``), and the conversations
    #: believed there that came back from it or did not.
    ram_switches: int = counter("Switches left to the engine's RAM prompt cache: nothing saved or restored")
    ram_hits: int = counter("Conversations left to the engine's RAM cache that came back from it")
    ram_misses: int = counter("Conversations left to the engine's RAM cache that were not there when they came back")

    #: Session files and their bytes, as of the last save or prune.
    files_on_disk: int = gauge("Session files on disk", summary="files")
    bytes_on_disk: int = gauge("Bytes of session files on disk", name="on_disk_bytes", unit="bytes",
                               summary="on disk")
    #: Session files beside a sidecar that is refused (not JSON, a field of another type):
    #: never restored, left alone.
    damaged_files: int = gauge("Session files whose sidecar is damaged")

    #: Parking in blocks (``blocks = true``): saves kept in blocks, the bytes they wrote
    #: (new blocks, tails, manifests) against the engine's bytes of the states they kept;
    #: saves kept whole because the engine's format refused the state, by reason
    #: (:class:`strata_serve.StateRefusal`); the store's blocks and bytes, and the bytes
    #: its sharing saves (what the conversations hold, counted per conversation, less
    #: what the store keeps).
    block_saves: int = counter("Saves kept in blocks of tokens")
    block_written_bytes: int = counter("Bytes saves in blocks wrote (new blocks, tails, manifests)", unit="bytes")
    block_state_bytes: int = counter("Bytes of engine state the saves in blocks kept", unit="bytes")
    restores_by_tokens: int = counter("Restores of the longest stored chain of blocks that prefixes the prompt, "
                                      "where it held more than the conversation's own state")
    restores_kept_whole: int = counter("Restores of a conversation in blocks read from its newest state, kept "
                                       "whole in memory since its save (no join)")
    blocks_refused_state_version: int = counter(_KEPT_WHOLE, name="blocks_refused",
                                                labels={"reason": "state_version"})
    blocks_refused_tokens_format: int = counter(_KEPT_WHOLE, name="blocks_refused",
                                                labels={"reason": "tokens_format"})
    blocks_refused_media: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "media"})
    blocks_refused_streams: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "streams"})
    blocks_refused_cells: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "cells"})
    blocks_refused_shifted: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "shifted"})
    blocks_refused_swa: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "swa"})
    blocks_refused_recurrent: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "recurrent"})
    blocks_refused_layout: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "layout"})
    blocks_refused_empty: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "empty"})
    blocks_refused_unreadable: int = counter(_KEPT_WHOLE, name="blocks_refused", labels={"reason": "unreadable"})
    blocks_stored: int = gauge("Blocks (and tails) in the block store")
    blocks_bytes: int = gauge("Bytes of the block store's blocks", unit="bytes")
    blocks_deduplicated_bytes: int = gauge("Bytes the block store does not keep twice", unit="bytes")

    #: The shared tier (``plugins.auto_sessions.shared``): files sent after a save, and
    #: those given up because another server had saved a newer turn (a lost
    #: compare-and-swap) or removed the conversation by hand; files fetched before a
    #: restore, those not worth it (or not for this engine), local copies set aside as
    #: older than the shared one or removed by another's ``sessions rm``.
    shared_uploads: int = counter("Session files uploaded to the shared tier")
    shared_uploaded_bytes: int = counter("Bytes uploaded to the shared tier", unit="bytes")
    shared_upload_ms: float = counter("Time spent uploading to the shared tier", name="shared_upload_seconds",
                                      unit="seconds", scale=1e-3)
    shared_upload_failures: int = counter("Uploads to the shared tier that failed (tried again)")
    shared_uploads_lost: int = counter("Uploads given up: another server had saved a newer turn")
    shared_uploads_removed: int = counter("Uploads given up: the conversation was removed by hand")
    shared_fetches: int = counter("Session files fetched from the shared tier")
    shared_fetched_bytes: int = counter("Bytes fetched from the shared tier", unit="bytes")
    shared_fetch_ms: float = counter("Time spent fetching from the shared tier", name="shared_fetch_seconds",
                                     unit="seconds", scale=1e-3)
    shared_fetch_failures: int = counter("Look-ups and fetches from the shared tier that failed")
    shared_fetches_not_worth: int = counter("Newer shared files not fetched: not worth it, or not for this engine")
    shared_stale_set_aside: int = counter("Local copies removed as older than the shared tier's")
    shared_removed_here: int = counter("Local copies removed after a removal by hand on another server")
    shared_damaged_heads: int = counter("Damaged heads the shared tier's sweep passed over")
    #: 1 when the store ignores conditional writes and shared mode was refused.
    shared_refused: int = gauge("Whether shared mode was refused (the store ignores conditional writes)")

    def snapshot(self) -> dict[str, float]:
        return asdict(self)

    def count_kept_whole(self, reason: str) -> None:
        """One more save kept whole: the engine's state format refused it for ``reason``."""
        field = f"blocks_refused_{reason}"
        if not hasattr(self, field):
            field = "blocks_refused_unreadable"  # a word this version does not know
        setattr(self, field, getattr(self, field) + 1)

    def count_refusal(self, reason: str) -> None:
        """One more file refused before the engine saw it, for ``reason`` (``store.REFUSAL_REASONS``)."""
        assert reason in REFUSAL_REASONS
        field = f"restores_refused_{reason}"
        setattr(self, field, getattr(self, field) + 1)

