def add_run_parser(sub):
    pass
