"""The fleet: replicas that materialise the update log. Snapshots of a model's tables in object storage (with the
log positions they were applied up to) and the bootstrap of an empty replica from them."""
