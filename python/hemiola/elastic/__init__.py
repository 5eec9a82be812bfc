"""Elastic membership of ``schedule="streaming"`` (``Config.coordinator``):
replicas that die are dropped without the others losing an inner step, and
replicas that start later join at a sync. ``coordinator.py`` is the server
(``hemiola coordinator``), ``client.py`` a replica's connection to it, and
``replica.py`` what a replica does when the membership changes."""
