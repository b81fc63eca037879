"""The interference benchmark (``benchmarks/interference.py``), in parts.

* ``fairness``: the rules the script enforces between arms: the engines' resolved
  configs compared key by key, equal server counts, one arrival file (pure).
* ``load``: the arrival file, the victims and the injector, run against one arm.
* ``report``: percentiles per injector rate, goodput, the verdict, the table and the
  plot.
"""
