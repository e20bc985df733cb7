"""Target-written training conversations for the drafter, as compact resumable shards.

A drafter learns what the target says in the contexts serving sees: chat requests
and the target's answers to them. This package has the target write that material
through the engine (plain decoding, ``Budget.off()``, batched), from many distinct
requests:

* **self-written**: the target, sampled with a per-request seed, writes a question or
  request a user might send about a subject (subjects from ``sources.SUBJECTS`` and
  words of the offline corpus); that exchange is kept too, and the question is then
  answered;
* **from offline text**: stdlib docstrings and reference topics (``treespark.training.corpus``)
  to explain or summarise, docstring first sentences turned into "write a function
  to ..." tasks, and small stdlib functions (their source) to explain, test or review;
* **multi-turn**: a follow-up user turn after the target's first answer, answered again.

Answers are greedy or sampled (T in ``GenConfig.temperatures``). Repetition loops are
cut (``generate.cut_repetition``) and empty or degenerate answers dropped. Heldout and
tuning prompts are never used (``reserved``, checked on every shard). Chat formatting
is ``treespark.models.chat.chat_ids``.

Terms: a *sample* is one stored sequence, a formatted conversation followed by one
target answer; its ``answer_start`` is the index where that answer begins (anchors go
on answer positions only). A *shard* holds the samples of ``GenConfig.conversations``
first-turn requests and is a deterministic function of (config, sources, shard index)
on given hardware; shards are written atomically, so a run can be killed at any moment
and resumed (here or on another machine) from the committed shards.

The modules:

* ``config``    ``GenConfig``: what a run generates, and its digest;
* ``sources``   where the requests come from: the offline material (``Sources``,
                ``default_sources``), the request templates, the questions the target
                writes (``clean_question``) and a shard's plan (``plan_shard``);
* ``reserved``  the held-out and tuning prompts that no request (and no training
                conversation, ``treespark.training.trainset``) may equal;
* ``shards``    the committed files: ``Sample`` and its kinds, atomic writes, reads,
                the manifest, ``load_answers``;
* ``generate``  the generation loop: the target writes a shard (``make_shard``), and
                ``generate_shards`` resumes from the committed shards.
"""
