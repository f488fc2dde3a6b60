"""The run directory: the product's memory. Only this folder knows the file names inside it.

Layout (format version 5; 1 to 4: runs of earlier releases, read as they are)::

    manifest.json              format, version, generation, every file with sha256 and size
    run.yaml                   method, PTM (name, args, sha256, data config), hyper-parameters (and
                               a switched run's ``frozen_track``: its frozen track's config)
    ptm.safetensors            PTM weights, only for --random-init runs
    stages/NNN/stage.json      classes, data fingerprint, options, metrics of stage NNN
    stages/NNN/weights.safetensors   stage parameters + real prototypes of its classes
    stages/NNN/statistics.safetensors  statistics of the stage's own classes (the ridge head's Q); read
                               only to learn a later stage, never for inference (releases before
                               format 3 also kept each stage's Gram increments here)
    stages/NNN/totals.safetensors  the newest stage only: the run's running totals (``heads.running``:
                               the ridge's Grams and W, the pooled scatters), superseded by the next
                               stage's commit, so a stage's reads and the run's size do not grow with T
    stages/NNN/weights-gGGGGGG.safetensors, statistics-gGGGGGG.safetensors, totals-gGGGGGG.safetensors
                               the same files as rewritten by the commit of generation GGGGGG
                               (``drl forget``): the manifest lists exactly one version of each
    forgotten/log-gGGGGGG.json the forget log: forgotten classes and every forget/restore (forget.py)
    forgotten/rows-gGGGGGG.safetensors  what the forget of generation GGGGGG took out of the stage
                               files (one class's slices), kept so that ``--restore`` can put it back
    stages/NNN/frozen-*, forgotten/frozen-*   a switched run only (``Schedule.switches``,
                               ``trackdir.py``): its frozen track's files (the frozen head learning
                               the same stages), committed with the run's (format 5; format 4 kept
                               them under ``frozen/``, listed in this manifest too)
    .lock                      writer lock (flock) with the holder's pid, host and start time
    .staging/                  files being written; never trusted, cleaned by the next writer
    .checkpoint/               the last finished epoch of an interrupted learn-stage (not part
                               of the model; checksummed; resumed or discarded by the next one)
    .quarantine/<time>/        leftovers a writer moved aside instead of deleting (unlisted
                               stage folders, unknown names in the run's own folders)

Every file is immutable once listed in the manifest. A commit writes new files into
``.staging``, fsyncs them, renames them into place under names no committed file uses, then
replaces ``manifest.json`` by an atomic rename and fsyncs the directory. A crash at any moment
leaves the old manifest (and the old state) or the new one. Readers trust only files the manifest
lists, and verify their sha256 on every read. Nothing here is ever unpickled.

A commit may also supersede listed files (``drl forget`` rewrites a stage's files under new names):
the new manifest no longer lists them and names them under ``superseded``; the writer deletes them
right after the commit point, and the next writer deletes any that a crash left. A run whose
manifest lists a frozen track's ``frozen-`` file is format version 5, one listing ``frozen/`` files
4, a totals file 3, a ``forgotten/`` file but no totals 2, every other 1: older releases refuse a
version they would misread, by its number.

Files are created, written, renamed and removed only through ``storage.py`` (fsynced, no links
followed); this folder decides which names they get.

A run directory is untrusted input (it is copied, downloaded, shared): no file or folder of a run
is ever followed out of it. Every access goes through the no-follow helpers (``access.py``) (``O_NOFOLLOW``
opens, ``lstat`` checks of every path component below the run's root), and a symbolic link where
the run keeps its own file or folder is refused (``IntegrityError``, exit 5). Writers delete only
names they create themselves; anything else they find in the run's folders is moved to
``.quarantine/`` with a logged warning, never deleted.

The folder, from the bottom: ``layout.py`` (the names), ``access.py`` (no-follow access),
``files.py`` (what bytes a file holds), ``checkpoint.py`` (the epoch checkpoint's sealed meta),
``lock.py`` (the writer lock, init's folder rules), ``writer.py`` (commits), ``directory.py``
(``RunDir``: reading, one generation at a time, and the writer), ``records.py`` (stage.json and
run.yaml as drl reads them), ``forgotten.py`` (the forget log and the active classes; ``slices.py``
checks a forgotten class's kept slices), ``trackdir.py`` and ``track.py`` (a switched run's frozen
track: its files, and its tie to the run's records), ``load.py`` (``load_run``: the model of a run).
"""
