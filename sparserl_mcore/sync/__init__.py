"""Parallel-aware sparse BF16 weight sync (docs/sync.md).

Public API (modules are imported explicitly; importing this package stays cheap):
- codec:       `CodecConfig(encoding="sub"|"xor"|"overwrite", zstd_level=1|None,
               position_model="base"|"plain")`, `encode_patch`, `decode_patch`, `resolve_positions`,
               `decode_fragments`, `inspect_patch`, `PatchError`
- positions:   the `base` position model (magnitude classes of the base values)
- diff:        `make_patch(old, new, version=, base_version=, anchor_version=)`, `full_patch(state, version=)`
- apply:       `apply_patch(state, data, version=)` (all-or-nothing), `HFReceiver`, `FragmentLedger`
- sharded:     `ShardedReceiver(layout, {(tp, pp): {mcore_name: tensor}})` (receiver with its own TP/PP)
- learner:     `ShardSyncer`, `build_sync_groups`, `distributed_optimizer_ranges`, `even_ranges`
- per_rank:    `split_by_receiver`, `encode_fragment`: each learner rank's own touched-digest fragments
- transports:  per-rank delivery in `trainer.weight_sync` (and `sglang.client` for SGLang workers),
               `transport_dir.DirectoryPublisher` / `DirectorySubscriber`
"""
