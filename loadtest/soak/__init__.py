"""The soak (``make soak``, ``python -m loadtest.soak``): lookups and sustained Kafka updates against ``hps serve``, judged on its plot."""
