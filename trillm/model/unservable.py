"""The refusal of a model file: in a module of its own, which the server's launcher catches
without importing the model code (torch) to know it."""


class UnservableModel(ValueError):
    """A model file trillm cannot serve, said in one line that names no path."""
