"""Errors caused by the user's input; the launcher prints them as one line and exits 2."""


class UserError(Exception):
    """A problem with the user's command line, config, files or data. The message names
    the problem and the fix."""
