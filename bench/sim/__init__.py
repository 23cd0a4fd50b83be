"""The simulated GPU fleet of ``bench/scale.py`` (not a bench itself: ``make bench`` runs only ``bench/*.py``).

``model``: the per-generator mode's stated distributions and speeds (response lengths, rewards, decode rates,
weight swaps, trainer speed, time scale); ``perf``: a preset's keys (``presets/*.yaml``) and the stated performance
model that derives decode, prefill, weight-update and training times from the model, the GPU and the fleet;
``fleetsim``: that model as a pure, fast fleet simulation (colocated sync, AReaL's split at a staleness bound);
``generators``: a child process running many simulated generators (or engines) on one event loop, their prompts
from Kafka (``prompts``); ``trainer``: a child process running the simulated trainer; ``fleet``: one run on real
brokers, a real feeder and real buffer processes, and its accounting; ``presetrun``: ``bench/scale.py --params``.
"""
