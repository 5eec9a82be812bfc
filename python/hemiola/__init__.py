"""hemiola: data-parallel training that schedules communication under computation."""
