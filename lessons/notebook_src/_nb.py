"""What every notebook generator shares: `md` and `code` append cells, `write` saves the notebook.

    from _nb import code, md, write
    md("# Lesson NN ...")
    code("print(1)")
    write(sys.argv[1])
"""
import nbformat as nbf

cells = []


def md(text):
    cells.append(nbf.v4.new_markdown_cell(text.strip("\n")))


def code(text):
    cells.append(nbf.v4.new_code_cell(text.strip("\n")))


def write(path):
    nb = nbf.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbf.write(nb, path)
