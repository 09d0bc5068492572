"""The main job ``lightning-cp``: configuration, the reference model, packed-text data, the run folder."""
