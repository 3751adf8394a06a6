"""Training the embedded default (issue 18): the toy world it learns from and the scores that judge its output."""
