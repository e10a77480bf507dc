"""`make bench`: Airlock's speed and scale as ratios against baselines measured in the same run."""
