from qwire.cli import entry

entry()
