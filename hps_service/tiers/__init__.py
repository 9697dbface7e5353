"""Storage tiers behind one interface (see :mod:`hps_service.tiers.base`)."""
