"""Host probes: measure this machine and fill the records :mod:`disttrain.simulate` reads.

The simulator (:mod:`disttrain.simulate`) is a pure cost model: it forks nothing and times
nothing. What it needs to know about a real host is measured here, with disttrain's own
strategies, training loop and benchmark, and handed over as two records of the model's
side, :class:`~disttrain.simulate.profile.ModelProfile` and
:class:`~disttrain.simulate.overheads.Overheads`. Measurements flow one way: probe → record
→ model; nothing in :mod:`disttrain.simulate` imports this package (``disttrain
simulate``'s command line, :mod:`disttrain.simulate.cli`, drives both).

* :mod:`.profiler`: profile a model (entry point): its layers split once, timed in rounds,
  and every overhead measured (:func:`~disttrain.probe.profiler.measure_registered`);
* :mod:`.layer_timing`: per-layer forward and backward times inside whole-model passes;
* :mod:`.wrappers`: every :class:`~disttrain.simulate.overheads.Overheads` quantity
  (:func:`~disttrain.probe.wrappers.measure_overheads`), the wrappers' own Python work on a
  one-rank communicator, and the multi-process probes' readings turned into prices;
* :mod:`.timing`: median and paired timings, the optimizer's and autograd's costs;
* :mod:`.contention`: forked ranks on this machine's cores: the slowdown of computing at
  once, a collective issued after compute, ZeRO-3's pattern; :mod:`.unit_ops` prices the
  latter per collective;
* :mod:`.stage_probe`, :mod:`.ps_probe`: a pipeline message and a stage's own work, a
  parameter-server pull and push, on the real runtimes;
* :mod:`.validate`: ``disttrain simulate --validate``, the model's prediction against
  ``disttrain bench``'s measured runs on this machine.

See docs/simulate.md.
"""
