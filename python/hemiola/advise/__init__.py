"""``hemiola advise``: which schedule and compression fit this model on this
network, from measurements made here; and what each would give at N ranks on
another network (``--world N --rate GBIT``), from a profile measured once.

- :mod:`~hemiola.advise.profile`: what is measured, kept as JSON;
- :mod:`~hemiola.advise.collective`: collectives at N ranks (alpha-beta);
- :mod:`~hemiola.advise.model`: one iteration of each configuration, on
  :mod:`~hemiola.advise.simulation` (the event simulation);
- :mod:`~hemiola.advise.models`: the model measured (``--model`` or the MLP);
- :mod:`~hemiola.advise.measure`: a profile measured on the job's ranks, with
  :mod:`~hemiola.advise.instruments` (one machine), :mod:`~hemiola.advise.wire`
  (the job's link) and :mod:`~hemiola.advise.agreement` (every rank the same
  profile);
- :mod:`~hemiola.advise.trials`: short runs of a configuration;
- :mod:`~hemiola.advise.choice`: trials, the advice, when streaming;
- :mod:`~hemiola.advise.cli`: the command and its report.
"""

from hemiola.advise.cli import register
from hemiola.advise.models import builtin_mlp, load_factory, slow_link_mlp

__all__ = ["builtin_mlp", "load_factory", "register", "slow_link_mlp"]
