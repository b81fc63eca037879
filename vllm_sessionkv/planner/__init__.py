"""The offline capacity planner (``sessionkv-plan``): ``model`` (a model's shape, KV
size and prefill FLOPs), ``capacity`` (hardware, links, pool and host-tier sizing) and
``plan`` (the command line).  Nothing at run time imports it; it prices with the
runtime's own cost model (``wire/cost.py``).  Documented in ``docs/planner.md``."""
