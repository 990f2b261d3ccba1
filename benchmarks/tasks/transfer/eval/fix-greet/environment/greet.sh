#!/bin/bash
ecko 'hi there' > out.txt
