"""The tasks of the convergence benchmark (:mod:`hemiola.bench.convergence`),
and the function each rank runs:

- :mod:`~hemiola.bench.tasks.data`: the corpora and the synthetic images;
- :mod:`~hemiola.bench.tasks.models`: the transformer LM, nanoGPT's GPT and the small ResNet;
- :mod:`~hemiola.bench.tasks.optim`: weight-decay groups and warmup + cosine;
- :mod:`~hemiola.bench.tasks.registry`: the tasks by name, their headline
  metrics and what is reported of each;
- :mod:`~hemiola.bench.tasks.runner`: ``train_rank``, one rank's run.
"""

from hemiola.bench.tasks.data import (
    corpus_info,
    load_corpus,
    load_packages,
    load_shapes,
    load_source,
    packages_info,
    shapes_info,
    source_info,
)
from hemiola.bench.tasks.registry import (
    DATA_INFO,
    DIGITS_ARCHITECTURES,
    HEADLINE,
    TASKS,
    CharTask,
    CodeTask,
    DigitsTask,
    Headline,
    LMTask,
    ShapesAdamWTask,
    ShapesTask,
    Task,
    metrics_of,
)
from hemiola.bench.tasks.runner import RankResult, train_rank

__all__ = ["DATA_INFO", "DIGITS_ARCHITECTURES", "HEADLINE", "TASKS", "CharTask", "CodeTask",
           "DigitsTask", "Headline", "LMTask", "RankResult", "ShapesAdamWTask", "ShapesTask",
           "Task", "corpus_info", "load_corpus", "load_packages", "load_shapes", "load_source",
           "metrics_of", "packages_info", "shapes_info", "source_info", "train_rank"]
