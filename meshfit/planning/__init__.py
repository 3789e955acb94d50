"""`meshfit.plan`: which layout, batch size and remat fit a model, and which is fastest."""
