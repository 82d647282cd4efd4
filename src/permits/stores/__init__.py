"""Stores carry out operations against one kind of storage. ``base`` says what every store must do;
the SQL stores live in ``permits._async.store`` and its generated twin ``permits._sync.store``."""
