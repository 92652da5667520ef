"""The synchronous engine core (scheduler driver, model runner, sampler) and its Trio front."""
