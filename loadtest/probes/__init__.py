"""One-off measurement tools outside ``make bench``: where the time goes, what a setting or a mode costs, device checks."""
