"""The simulated GPU fleet of ``bench/scale.py`` (not a bench itself: ``make bench`` runs only ``bench/*.py``).

``model``: the stated distributions and speeds (response lengths, rewards, decode rates, weight swaps, trainer
speed, time scale); ``generators``: a child process running many simulated generators on one event loop;
``trainer``: a child process running the simulated trainer; ``fleet``: one run on real brokers and real buffer
processes, and its accounting.
"""
