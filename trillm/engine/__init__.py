"""The request side: the synchronous core (scheduler driver, sampler, grammars, outputs) and its
Trio front. It drives the model side, trillm.model, through `ModelRunner`."""
