"""Checkpoints: one format for every strategy, written atomically, read without running code.

The package, by concern (docs/architecture.md):

- `format`: what a checkpoint directory holds, the checks ``ember.pt`` must pass, the errors;
- `files`: fsync, atomic replacement, writes that fail cleanly, reads that never block (used by the
  loggers and exports too);
- `writing`: one process or many, sync or staged for a background finish, the ``last`` pointer;
- `reading`: metadata, ``ember.pt``, tensors, loading weights with errors that say what differs;
- `bounds`: every size a file claims (a tensor's shape and dtype, a chunk's place in a shard, a record's
  length, the file's own size) checked against the files before anything is read or allocated;
- `store`, `manifest`, `mirror`, `upload_process`, `shared_commit`: object storage (``s3://``, any fsspec URL):
  URLs told from paths, the commit protocol without rename (files, then a manifest, then ``last``), a run's
  checkpoints uploaded in the background by a worker process, by every process of a job with process 0
  committing them once all uploaded;
- `locating`: run directories (claimed atomically), ``last``, ``best``, what a ``ckpt_path`` names;
- `dcp_writer`, `dcp_metadata`: torch.distributed.checkpoint's files, written fast for one process and
  read through a restricted unpickler;
- `registry`: what goes *into* a checkpoint (the named `Stateful` objects), gathered and restored;
- `manager`: the trainer's `CheckpointManager`: which checkpoint a ``ckpt_path`` names, writes at step
  boundaries (sync or in the background), restoring;
- `resume`, `data_position`: random streams and the exact data position across a resume.

When to save and what to keep is `ember.callbacks.ModelCheckpoint`'s; the manager decides how.
`registry`, `manager`, `resume` and `data_position` are imported where they are used (not here), so
reading a checkpoint's files never loads them.
"""

from ember.checkpoint.format import (
    FORMAT_VERSION,
    LAST_FILE,
    META_FILE,
    CheckpointError,
    CheckpointWriteError,
    join_checked,
    join_tensors,
    split_tensors,
)
from ember.checkpoint.locating import (
    CHECKPOINT_SUBDIR,
    NewestRunHasNoCheckpoint,
    check_last_replaceable,
    checkpoints_in,
    claim_version,
    describe,
    epoch_label,
    find_best,
    find_last,
    is_fit_run,
    newest_valid,
    read_pointer,
    recorded_best,
    release_if_empty,
    resolve_ckpt_path,
    resolve_path,
    run_dir_of,
    summarize,
    versions_newest_first,
)
from ember.checkpoint.manifest import fetch_checkpoint
from ember.checkpoint.reading import (
    check_complete,
    differences,
    load_weights_into,
    mismatch_hint,
    read_meta,
    read_metadata,
    read_module_state,
    read_rank_meta,
    read_shards,
    read_tensors,
)
from ember.checkpoint.store import is_url
from ember.checkpoint.writing import (
    StagedCheckpoint,
    point_last_at,
    save_weights,
    stage_checkpoint,
    write_checkpoint,
)

__all__ = [
    "CHECKPOINT_SUBDIR",
    "FORMAT_VERSION",
    "LAST_FILE",
    "META_FILE",
    "CheckpointError",
    "CheckpointWriteError",
    "NewestRunHasNoCheckpoint",
    "StagedCheckpoint",
    "check_complete",
    "check_last_replaceable",
    "checkpoints_in",
    "claim_version",
    "describe",
    "differences",
    "epoch_label",
    "fetch_checkpoint",
    "find_best",
    "find_last",
    "is_fit_run",
    "is_url",
    "join_checked",
    "join_tensors",
    "load_weights_into",
    "mismatch_hint",
    "newest_valid",
    "point_last_at",
    "read_meta",
    "read_metadata",
    "read_module_state",
    "read_pointer",
    "read_rank_meta",
    "read_shards",
    "read_tensors",
    "recorded_best",
    "release_if_empty",
    "resolve_ckpt_path",
    "resolve_path",
    "run_dir_of",
    "save_weights",
    "split_tensors",
    "stage_checkpoint",
    "summarize",
    "versions_newest_first",
    "write_checkpoint",
]
